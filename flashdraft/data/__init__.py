"""Data: from users' records to the token rows the trainer reads.

Owns the input formats (`formats`), chat-template rendering and loss masks (`template`, with
its verified fast path in `template_fast`), the prepared Arrow dataset (`dataset`), the
`prepare` pipeline and the `audit` checks, and on-policy regeneration with the target
(`generate`, over the batched `inference` backends). May import `flashdraft.model` (to load
the target for generation) and the base layer (`config`, `storage`, `log`); never `train`,
`eval` or `commands`.
"""
