"""verl >= 0.9 plugin (entry point group `verl.plugins`): `import verl` loads it in every verl
process, which imports the verl adapter; the adapter registers QrqRewardManager under the name
"qrq", so `reward.reward_manager.name=qrq` selects it without an import path.
(`VERL_USE_EXTERNAL_PLUGINS=none` turns verl's plugin loading off.)
"""

from __future__ import annotations

from . import verl  # noqa: F401  (registers "qrq" once its class exists)
