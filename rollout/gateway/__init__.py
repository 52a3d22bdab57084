"""The agent gateway (DESIGN.md "Agent gateway"): agents written against the OpenAI API run unchanged
against the fleet, and every completion they ask for is recorded token for token.

Modules: ``openai_api`` (wire shapes, errors, SSE), ``toolcalls`` (tool-call parser registry),
``recording`` (segments, prefix matching), ``episodes`` (episode store, grouping, pushing),
``calls`` (one chat / text completion), ``agents`` (in-service agents), ``gateway`` (the object the
rollout service owns), ``routes`` (HTTP).
"""
