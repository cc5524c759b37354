"""Wire formats: the OpenAI request models and SSE, endpoint codecs, stream monitors."""
