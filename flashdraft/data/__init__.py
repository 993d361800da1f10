"""Data: from users' records to the token rows the trainer reads.

Owns the input formats (`formats`), chat-template rendering and loss masks (`template`, the
reference, and its verified fast path `template_fast`), the prepared Arrow dataset
(`dataset`), the `prepare` pipeline (`prepare`, its options in `prepare_config`, over the
parallel shard machinery `shards`), the `audit` checks and the sample `preview`, and
on-policy regeneration with the target (`generate`: `jobs` in, the append-only `output_log`
out, over the batched `inference` backends, `fast_inference` the static-cache
continuous-batching one), and the prompts of the reference recipe split by source
(`sources`). Each command's options are one typed config here (`PrepareConfig`,
`AuditConfig`, `GenerateConfig`). May import `flashdraft.model` (to load the target for
generation) and the base layer (`config`, `storage`, `log`); never `train`, `eval` or
`commands`.
"""
