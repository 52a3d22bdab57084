"""Headrace: decoupled RL post-training for language models.

This folder is only the root of the import namespace. The code lives in the repository's
service folders and is installed beneath it: ``headrace.shared``, ``headrace.buffer``,
``headrace.rollout``, ``headrace.trainer`` and ``headrace.deploy`` (pyproject's package-dir map).
"""

__version__ = "0.1.0"
