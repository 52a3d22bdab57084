"""Contracts the Headrace services share: wire schemas, config, clients, plugins, weight sync.

Nothing in this package imports a service (rollout, buffer, trainer) or, at import time, torch.
"""
