"""Speculative decoding in one place: what drafts, what it costs, and who decides.

- `proposers`: the proposer interface and its capability record, n-gram prompt
  lookup and Predicted Outputs; `suffix` / `suffix_tree` (suffix decoding),
  `device_draft` / `draft_model` / `eagle` (proposers that draft with forwards).
- `host_drafts`: model-free drafts made once per step on the step thread.
- `estimates`: per-row acceptance, shrunk toward peers and calibrated per proposer.
- `cost_model`: the step's time, learned online; `config`: the settings; `policy`: per step and per row,
  how many tokens to draft.
- `rejection`: the lossless verify.
"""
