"""Cue phrases of the classifier's rubric features, by group, and the counter that finds them.

Each group is one line of the label rubric (code, math, planning, long-form writing, small talk,
...). A phrase is one to three lower-cased words; `cue_counts` counts, per group, the phrases
found in a list of words with one dictionary lookup per word, bigram and trigram. Pure Python:
this runs on the gateway's hot path.
"""

from __future__ import annotations

__all__ = ["CUES", "cue_counts"]

# Cue phrases, by group. One to three words each, matched on lower-cased word tokens.
CUES: dict[str, str] = {
    "code_kw": (
        "code coding function functions python javascript typescript java golang rust ruby php "
        "sql html css regex algorithm algorithms program programming compile compiler debug "
        "bug bugs api recursion recursive implement implementation snippet syntax runtime "
        "refactor dataframe pandas numpy kotlin swiftui bash shell linux "
        # computer-science concepts (rubric: "explaining code, programming concepts included")
        "np-hard np-complete self-attention transformers backpropagation cryptography"
        "|command-line "
        "|time complexity|linked list|binary tree|data structure|data structures|unit test"
        "|unit tests|source code|big o|machine learning|neural network|neural networks"
        "|turing machine|language model|language models|computer science|gradient descent"
    ),
    "math_kw": (
        "calculate calculation compute solve equation equations integral derivative prove proof "
        "theorem inequality probability factorial sqrt logarithm polynomial quadratic algebra "
        "geometry arithmetic|square root|prime number|prime numbers|compound interest"
    ),
    # math words that are as often about text or everyday things ("divide this list into two
    # paragraphs", "a chemical formula"): they count only next to numbers
    "math_weak_kw": (
        "percent percentage average median perimeter area volume radius diameter circumference "
        "ratio fraction remainder divisible multiply divide divided squared formula sum"
    ),
    "wordprob_kw": (
        "total each per twice half triple double left remaining spent spend spends earn earns "
        "earned costs cost buys bought sells sold pays paid saves saved week weeks month "
        "hours minutes miles dollars cents|how many|how much|how long|how far|how old"
    ),
    "reason_kw": (
        "puzzle riddle logic logical reasoning deduce infer estimate estimation assumptions "
        "assume suppose hypothetical paradox dilemma implications tradeoffs trade-offs "
        "consequences step-by-step|step by step|what would happen|false or uncertain"
        "|think through|validate|disprove|refute"
    ),
    "plan_kw": (
        "plan planning itinerary schedule budget curriculum roadmap strategy design architecture "
        "outline proposal instructions recipe guide tutorial procedure steps step-by-step "
        "to-do todo checklist"
        "|how to|how do i"
        "|how can i|how should i|how would you|step by step"
    ),
    "create_verb": "write compose create draft craft generate pen produce develop|come up with",
    "longform_noun": (
        "story stories poem poems essay letter email script dialogue dialog conversation song "
        "lyrics haiku limerick sonnet speech article blog narrative report review screenplay "
        "jingle rap fable tale pitch biography monologue paragraphs chapter novel ode ballad "
        "verse skit|blog post|cover letter"
    ),
    "brevity": (
        "briefly tweet|one sentence|a sentence|single sentence|one line|one-line|one word"
        "|single word|a word|two words|three words|a phrase|in short|yes or no|true or false"
        "|few words|short answer|two sentences|three sentences"
    ),
    "oneliner_noun": (
        "title slogan tagline headline caption metaphor simile hashtag pun motto nickname acronym "
        "synonym synonyms antonym antonyms rhyme rhymes sentence phrase word passphrase password"
    ),
    "explain_kw": (
        "explain explanation describe discuss elaborate analyze analyse analysis evaluate justify "
        "argue critique detailed thorough comprehensive insights|how does|how do|how did|how is"
        "|how are|how can|how would|what causes|in detail|in depth|why does|why do|why is|why are"
        "|in what ways|fleshed out"
    ),
    "compare_kw": (
        "compare contrast comparison versus vs|difference between|differences between"
        "|pros and cons|advantages and disadvantages|similarities between|similarities and"
        "|differentiate between|distinguish between"
    ),
    "topic_kw": (
        "challenges opportunities implications|history of|evolution of|impact of|effects of"
        "|effect of|importance of|role of|significance of|future of|causes of|impacts of"
        "|effects on|impact on|roots of|origins of"
    ),
    "simple_task": (
        "classify categorize identify name list translate rewrite paraphrase rephrase edit "
        "correct sort rank extract summarize summarise spell define definition sentiment "
        "label tag detect pick choose select capitalize punctuate shorten|tell me whether"
        "|which of|which one|what is|who is|who was|when was|when did|where is|what are"
        "|positive or negative|fact or opinion|is this"
    ),
    "tips_kw": "tips ideas suggestions ways examples recommendations things|a few|some ideas",
    "lookup_kw": "|how many|how much|how long|how far|how old|how tall|how big|how often|is it true",
    "given_kw": (
        "following given above below|based on|according to|from the text|in the text"
        "|this paragraph|this passage|the passage|the paragraph|this text|this sentence"
    ),
    "greet_kw": (
        "hi hello hey hiya howdy greetings thanks thank bye goodbye sup yo|good morning"
        "|good evening|good night|good afternoon|see you|how are you|what's up|nice to meet"
    ),
    "identity_kw": (
        "yourself chatbot siri alexa cortana|who are you|what are you"
        "|your name|are you|do you|can you|you are|you're|who made|who created|who built"
        "|your favorite|your favourite|who trained"
    ),
    "feeling_kw": (
        "bored sad happy lonely tired sorry love hate kiss hug joke lol haha stupid annoying "
        "funny cute awesome boring friend marry date lonely"
    ),
    "followup_kw": (
        "previous above earlier rework revise rephrase again instead|what if|what about"
        "|how about|your answer|your response|your solution|your previous|the same"
    ),
    # --- the kinds of complex request that carry none of the cue words above ---
    # rubric "long-form writing": documents that are several paragraphs by nature, though no
    # story/essay/letter word names them ("a movie plot", "a whitepaper", "a scope of work")
    "gen_object_kw": (
        "plot synopsis storyline backstory whitepaper introduction intro overview scenario "
        "campaign lesson sermon eulogy toast advertisement commercial newsletter manual "
        "documentation contract agreement resume résumé bio profile quest adventure episode "
        "sequel prologue epilogue ending fanfic fanfiction lore myth legend presentation lecture "
        "obituary manifesto brochure flyer interview debate rebuttal description analysis "
        "worldbuilding|white paper|scope of|press release|business plan|pitch deck|ad copy"
        "|job description|product description|user manual|lesson plan|case study|short film"
        "|mission statement|code of|terms of|an outline"
    ),
    # rubric "long-form writing" / "multi-paragraph explanations": an imperative that asks the
    # model to produce text, whatever the object ("tell me about X", "describe a world where")
    "open_verb_kw": (
        "write compose draft create generate invent imagine design develop craft produce "
        "describe narrate elaborate outline expand|tell me about|talk about|tell me everything"
        "|teach me|walk me through|an overview of|write up|make up|flesh out|tell me more"
        "|go through|dive into|explain to me"
    ),
    # rubric "multi-step reasoning": a counterfactual needs a chain of consequences
    "counterfactual_kw": (
        "hypothetically hypothetical hadn't suppose supposing|what if|if you could|if you were"
        "|if i were|if we were|if humans|if people|would have|could have|had never|had not"
        "|imagine if|imagine a|alternate history|alternative history|in a world|would happen"
        "|would change|would it be|would the world|would life"
    ),
    # rubric "non-trivial arithmetic or unit conversion": operations and units in words;
    # counted only next to quantities (digits or number words)
    "op_word_kw": (
        "times multiplied multiply product sum plus minus divided quotient squared cubed "
        "percent percentage convert conversion converted celsius fahrenheit kelvin angle angles "
        "triangle degrees average total interest speed distance perimeter area volume remainder "
        "fraction decimal exponent power root hypotenuse radius diameter ratio mph miles "
        "kilometers feet inches meters centimeters pounds kilograms ounces grams liters gallons "
        "cups|how many|how much|how long|how far|how old"
    ),
    # rubric "writing, debugging or explaining code (programming concepts included)":
    # frameworks, tools and languages name a code request without the word "code"
    "code_api_kw": (
        "react reactjs angular vue svelte django flask fastapi nodejs npm yarn webpack "
        "vite nextjs nuxt laravel symfony dotnet unity unreal godot pygame "
        "tkinter pyqt electron flutter dart swift kotlin xcode tensorflow pytorch keras sklearn "
        "scikit-learn huggingface opencv matplotlib seaborn jupyter docker dockerfile kubernetes "
        "k8s helm terraform ansible nginx git github gitlab jenkins aws azure gcp s3 ec2 firebase "
        "postgres postgresql mysql sqlite mongodb redis graphql restful json yaml xml jquery "
        "bootstrap tailwind wordpress vba powershell vim emacs vscode latex arduino raspberry "
        "esp32 verilog vhdl assembly asm haskell lisp clojure scala elixir erlang lua perl "
        "fortran cobol matlab julia solidity ocaml f# c++ c# cuda opengl vulkan webassembly "
        "wasm selenium scrapy beautifulsoup api apis sdk cli repo repository backend frontend "
        "|node js|next js|asp net|spring boot|ruby on rails|excel formula|google sheets"
        "|smart contract|rest api"
        "|command line|visual studio|stack overflow|pull request|web app|web server"
    ),
    # ... and so do the constructs of a programming language, though each alone is weaker
    # ("a list", "a string", "a class" also have everyday senses)
    "code_construct_kw": (
        "class classes method methods variable variables loop loops array arrays string strings "
        "integer integers boolean pointer pointers struct enum interface inheritance "
        "polymorphism closure closures callback promise promises async await thread threads "
        "mutex deadlock exception exceptions stack heap queue hashmap dictionary dict tuple "
        "lambda generator iterator decorator module library framework dependency compiler "
        "interpreter bytecode debugger stdout stdin regex query schema database endpoint socket "
        "http cookie oauth jwt webhook terminal script shell bash zsh linux unix ubuntu "
        "object-oriented oop typescript|hash table|linked list|for loop|while loop"
        "|list comprehension|null pointer|type error|syntax error"
    ),
    # rubric "multi-step logical reasoning, puzzles": the shapes puzzles come in
    "puzzle_kw": (
        "riddle riddles unscramble anagram anagrams syllogism sudoku|odd one out|odd man out"
        "|does not belong|doesn't belong|next number|comes next|the sequence"
        "|number sequence|brain teaser|logic puzzle|how many letters|the letter"
        "|knights and knaves|truth teller|missing number|the pattern"
    ),
    # rubric "planning", asked as a question rather than as "make a plan"
    "plan_q_kw": (
        "|your plans|your plan|your strategy|first 30|first 60|first 90|first 100|first week"
        "|what would you|what should i|what should we|how should i|how should we"
        "|what steps|which steps|steps should|steps would|steps to|how to prepare|how to start"
        "|get started|best way to|go about|approach this|prepare for"
    ),
    # rubric "long-form writing or analysis": an open question of value, ethics or opinion
    # needs an argued answer, not a lookup ("Is tourism a necessary evil?")
    "discuss_kw": (
        "morally moral morality ethical ethics unethical philosophy philosophical justice "
        "consciousness sentient society societal impacts objectively subjective meaning "
        "controversial justified valuable illusion evil|do you think|your opinion|your view"
        "|your thoughts|is it ethical|is it okay|is it right|should we|free will|human nature"
        "|the meaning|the future|pros and|the role|the relationship|the relation"
    ),
    # rubric "estimation (Fermi) questions": a quantity nobody looked up, to be reasoned out
    "estimate_kw": (
        "estimate roughly approximately|would it take|would you need|do you need|does it take"
        "|on average|an average|per year|in a year|in one year|every year|in the world"
        "|on earth|in total|how many people"
    ),
    # the train set's convention: a persona or roleplay set-up asks for an in-character answer
    "roleplay_kw": (
        "pretend roleplay role-play persona|act as|act like|you are a|you are an|you're a"
        "|you're an|role play|in character|imagine you|as if you|the role|from now on"
    ),
}


def _build_lookup() -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]],
                             dict[str, tuple[str, ...]]]:
    maps: tuple[dict[str, list[str]], ...] = ({}, {}, {})
    for group, spec in CUES.items():
        singles, *phrases = spec.split("|")
        for phrase in singles.split() + [p.strip() for p in phrases]:
            words = phrase.split()
            if len(words) > 3:      # the counter looks at trigrams at most
                raise ValueError(f"cue group {group!r}: {phrase!r} is longer than three words")
            if words:
                groups = maps[len(words) - 1].setdefault(" ".join(words), [])
                if group not in groups:     # a phrase counts once per group
                    groups.append(group)
    uni, bi, tri = ({k: tuple(v) for k, v in m.items()} for m in maps)
    return uni, bi, tri


_UNI, _BI, _TRI = _build_lookup()


def cue_counts(words: list[str]) -> dict[str, int]:
    """Per cue group, how many of its phrases occur in `words` (lower-cased word tokens)."""
    counts: dict[str, int] = {}
    n = len(words)
    for i, w in enumerate(words):
        for g in _UNI.get(w, ()):
            counts[g] = counts.get(g, 0) + 1
        if i + 1 < n:
            bi = w + " " + words[i + 1]
            for g in _BI.get(bi, ()):
                counts[g] = counts.get(g, 0) + 1
            if i + 2 < n:
                for g in _TRI.get(bi + " " + words[i + 2], ()):
                    counts[g] = counts.get(g, 0) + 1
    return counts
