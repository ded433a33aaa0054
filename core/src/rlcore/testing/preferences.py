"""A synthetic preference task a tiny model learns in seconds, for tests and the tiny recipes.

Each pair answers a prompt (``word for <letters>:``) twice: the chosen response is a run of
vowels, the rejected one a run of consonants, both 3-6 letters long. A held-out pair is new
strings of the same two kinds, so a model that ranks it right has learned the preference, not
the pairs. ``python -m rlcore.testing.preferences OUT.jsonl [N]`` writes N rows as chat messages
(the form of ``recipes/data/preference_vowels.jsonl``).
"""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

VOWELS = "aeiou"
CONSONANTS = "".join(c for c in string.ascii_lowercase if c not in VOWELS)


def vowel_preference_rows(n: int, seed: int = 0, *, messages: bool = True) -> list[dict]:
    """``n`` rows ``{prompt, chosen, rejected}``: chat messages, or plain text with ``messages=False``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = "word for " + "".join(rng.choice(string.ascii_lowercase) for _ in range(3)) + ":"
        chosen = "".join(rng.choice(VOWELS) for _ in range(rng.randint(3, 6)))
        rejected = "".join(rng.choice(CONSONANTS) for _ in range(rng.randint(3, 6)))
        if messages:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


if __name__ == "__main__":
    write_jsonl(sys.argv[1], vowel_preference_rows(int(sys.argv[2]) if len(sys.argv) > 2 else 384))
