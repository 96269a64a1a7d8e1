"""One engine step on the device: the model runner that joins the target (`models`) and its
proposer (`speculation`), and the builder that assembles them.

- `runner`: `ModelRunner.execute(batch)`: host drafts and one upload, the device
  proposer's drafts, one packed target forward, sampling / verify, one download.
- `step_sampling`: the step's host plan (`PreparedStep`) and its sampling and verify.
- `builder`: `build_runner`: the target, the proposer from `speculation.registry`, the KV pool's size.
"""
