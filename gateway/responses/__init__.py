"""OpenAI's Responses API: its codec, monitor, replay, by-id endpoints and response affinity."""
