"""test/checkpointed_training.py's function as a command line's Python script.

python checkpointed.py CONFIG_JSON    runs checkpointed_sum(CONFIG), prints where it resumed
python checkpointed.py drains FOLDER FRAMEWORK    runs steps_told_of_drains(FOLDER, FRAMEWORK)
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: test.*

from test.checkpointed_training import checkpointed_sum, steps_told_of_drains  # noqa: E402

if sys.argv[1] == "drains":
    print(json.dumps(steps_told_of_drains(sys.argv[2], sys.argv[3])))
else:
    result = checkpointed_sum(json.loads(sys.argv[1]))
    print(f"rank {result['rank']} resumed from {result['resumed_from']}, state {result['state']}")
