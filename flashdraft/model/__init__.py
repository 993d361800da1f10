"""Model: single-device module code of the drafter and the frozen target.

Owns the drafter's geometry (`config`), the one DFlash `mask_mod` and its two attention
backends (`attention`), the draft model with its decode cache (`drafter`), the target's
frozen embedding and LM head (`head`), and the target itself: loading, layer taps and the
packed forward (`target`), exact packing of hybrid linear-attention targets (`hybrid`), and a
static-KV-cache forward over a dense target's own submodules for fast decoding (`static`,
its decoder layers' dense parts in `static_layers`), and the CUDA graphs and graph-safe
sampling its decode loops replay (`graphs`). Distribution, compilation and optimisation are
applied from outside (`flashdraft.train.parallel`). May import only the base layer (`config`,
`storage`, `log`).
"""
