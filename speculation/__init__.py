"""Speculative decoding in one place: what drafts, what it costs, and who decides.

- `proposer`: the one proposer interface (every hook with a default) and `Drafting`,
  what the policy may ask a runner; `registry`: every proposer by name, with its
  capabilities, default K and the option it needs; `config`: `ProposerConfig` (which
  proposer, its options) and `SpecConfig` (the policy's knobs).
- Proposers, one module each: `ngram` (prompt lookup), `prediction` (Predicted Outputs),
  `suffix` / `suffix_tree` (suffix decoding), `draft_model` and `eagle` (drafting with
  forwards on the device, through `device_draft`'s plan and K-forward loop).
- `host_drafts`: model-free drafts made once per step on the step thread.
- `estimates`: per-row acceptance, shrunk toward peers and calibrated per proposer.
- `cost_model`: the step's time, learned online; `policy`: per step and per row, how
  many tokens to draft.
- `rejection`: the lossless verify.

speculation/ imports models/ (the device proposers run its forwards), never the reverse;
the worker (`worker/`) drives both.
"""
