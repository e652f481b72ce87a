"""Which prompts and completions train: the batch-selection stages (config ``filters: [...]``).

Four kinds, each with its own small protocol; the step's batch assembly (``postrl.step.sampling``) calls each once
per step, in this order:

* ``selector`` (:mod:`postrl.selection.selectors`): picks the step's prompts from a pool before any rollout;
* ``sampling`` (:mod:`postrl.selection.sampling`): a plan of per-completion sampling temperatures;
* ``expansion`` (:mod:`postrl.selection.expansions`, :mod:`postrl.selection.guidance`): new scored groups made from
  the scored batch, or rows joining its groups (external demonstrations, teacher-hinted retries);
* ``filter`` (:mod:`postrl.selection.filters`): keep masks over the scored batch, with refill (``max_attempts``).
"""

from __future__ import annotations

from postrl.selection import expansions, filters, guidance, sampling, selectors  # noqa: F401  (they register stages)

