"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): one more way in to the chat
machinery. A Messages request is translated into a chat completions body and goes through the same
admission, quotas, classes, fair queues and prefix cache; its answer is rendered in Anthropic's shape."""
