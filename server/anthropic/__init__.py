"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), an adapter
over the chat path with Anthropic's request, response, event and error shapes."""
