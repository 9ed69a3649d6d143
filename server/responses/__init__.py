"""OpenAI's Responses API (`/v1/responses`): input items turned into a chat-shaped request,
output items and their stream events, and the store behind `previous_response_id`."""
