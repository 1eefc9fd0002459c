"""Models are built and loaded one at a time in a process: transformers' loaders patch globals.

While it builds a model, transformers 5 changes process-wide state and puts it back afterwards:
`from_pretrained` replaces `PreTrainedModel.tie_weights` by a no-op (`initialization.no_tie_weights`)
and sets torch's default dtype (`local_torch_dtype`); `from_config` sets the default dtype too. Each
context saves what it finds and restores that at its end, so two overlapping calls in two threads
undo each other: the second saves the first's no-op and restores it last. Then no model built in
that process ties its embeddings again (a Qwen2 with ``tie_word_embeddings=True`` got an `lm_head` of
its own: tests/trainer_core/test_target_modules.py failed after tests/trainer_core/test_builtin_cache.py
raced two loads). Two concurrent loads left `tie_weights` a no-op in 14 of 20 tries.

`one_at_a_time` serialises the calls that run under those contexts in this package's loaders
(`builtin`, `registry`, `tiny`). Code elsewhere that builds models in threads should hold it too.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()


@contextmanager
def one_at_a_time() -> Iterator[None]:
    """Held around a transformers model construction (`from_pretrained`, `from_config`, a model
    class called with its config): no other thread of the process builds one meanwhile."""
    with _LOCK:
        yield
