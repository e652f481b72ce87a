"""Which prompts and completions train: the batch-selection stages (config ``filters: [...]``).

Four kinds, each with its own small protocol; the step's batch assembly (``postrl.step.sampling``) calls each once
per step, in this order:

* ``selector`` (:mod:`postrl.selection.selectors`): picks the step's prompts from a pool before any rollout;
* ``sampling`` (:mod:`postrl.selection.sampling`): how a group's completions are generated (per-completion
  temperatures, per-completion prompt templates);
* ``expansion`` (:mod:`postrl.selection.expansions`, :mod:`postrl.selection.guidance`): new scored groups made from
  the scored batch, or rows joining its groups (external demonstrations, teacher-hinted retries); ``avatar_replay``
  (:mod:`postrl.selection.replay`) puts stored groups in the slots of groups without signal;
* ``filter`` (:mod:`postrl.selection.filters`): keep masks over the scored batch, with refill (``max_attempts``);
  ``trapo`` (:mod:`postrl.selection.trapo`) is a stateful one (it records every group it judged).

Stateful stages among them record in ``observe`` and change their state once per step (``end_step``): a selector
every generated group, a keep filter every group it judged (``Step.keep``), an expansion the step's final batch.
"""

from __future__ import annotations

from postrl.selection import expansions, filters, guidance, sampling, selectors  # noqa: F401  (they register stages)
from postrl.selection import replay, trapo  # noqa: F401,E402  (issue 31: TraPO, AVATAR's replay)

