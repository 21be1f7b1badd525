"""One attention implementation per model at a time, whatever the number of threads using it.

A HF model's attention implementation is a field of its config, so switching it (ragattn's
``use_ragattn``, a baseline that runs "sdpa") changes it for every thread that runs the model.
:func:`attention_implementation` makes the switch shared and counted: the first user of an
implementation switches the model, later users of the same implementation run alongside it, the
last one to leave restores what the model had; a user of another implementation waits until the
model is free. A thread that asks for another implementation while it already runs the model
under one (a nested switch, which would wait for itself) gets a RuntimeError."""
from __future__ import annotations

import contextlib
import threading
import weakref


class _Use:
    __slots__ = ("cond", "active", "count", "saved", "__weakref__")

    def __init__(self):
        self.cond = threading.Condition()
        self.active = None     # the implementation the current users run
        self.count = 0         # how many context managers are inside
        self.saved = None      # what the model had before the first of them


_USES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_USES_LOCK = threading.Lock()
_mine = threading.local()      # per thread: id(model) -> how deep this thread is inside


def _use_of(model) -> _Use:
    with _USES_LOCK:
        u = _USES.get(model)
        if u is None:
            u = _USES[model] = _Use()
        return u


@contextlib.contextmanager
def attention_implementation(model, name: str, switch):
    """Run the body with ``model``'s attention implementation ``name`` (shared by the threads that
    ask for the same one; see the module docstring). ``switch(model, old, new)`` performs a switch."""
    u = _use_of(model)
    depth = _mine.__dict__.setdefault("depth", {})
    inside = depth.get(id(model), 0)
    with u.cond:
        while u.count and u.active != name:
            if inside:
                raise RuntimeError(f"ragattn: attention implementation {name!r} asked for inside a block that runs "
                                   f"this model with {u.active!r} in the same thread (a nested switch)")
            u.cond.wait()
        if u.count == 0:
            old = model.config._attn_implementation
            if old != name:
                switch(model, old, name)
            u.saved, u.active = old, name
        u.count += 1
    depth[id(model)] = inside + 1
    try:
        yield model
    finally:
        if inside:
            depth[id(model)] = inside
        else:
            depth.pop(id(model), None)
        with u.cond:
            u.count -= 1
            if u.count == 0:
                try:
                    if u.saved != name:
                        switch(model, name, u.saved)
                finally:
                    u.active = None
                    u.cond.notify_all()
