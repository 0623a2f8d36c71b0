"""Build instances of frozen slotted dataclasses for less than their ``__init__``.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (its own
``__setattr__`` refuses), which costs more than building the object at all: for the 30
fields of the server's ``Task`` about 5 µs, and an EnqueueBatch of a thousand tasks
builds a thousand of them (the SDK reads a thousand ``TaskInfo`` back).
:func:`constructor` makes a function that takes the same keyword arguments and stores
them as a plain class's ``__init__`` would, in well under half the time; what it returns
is the object ``__init__`` would have made (equal, same hash).

It lives here, beside the generated wire code, because it is the one package both the
SDK and the server build on (the SDK imports no server package); it knows nothing of the
wire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def constructor(cls: type[T]) -> Callable[..., T]:
    """A keyword-only constructor of the frozen, slotted dataclass ``cls``, equivalent to
    ``cls(**fields)``. A field with a default may be left out; one with a
    ``default_factory`` must be given. Refused (TypeError): a class that is not a slotted
    dataclass, or one with a ``__post_init__`` (the constructor would skip it).

    How: the fields are stored on an instance of a plain (not frozen) twin class with the
    same slots, by ordinary attribute stores, and the instance then becomes a ``cls``
    (``__class__`` assignment, which CPython allows between classes of one layout). Where
    that is refused, each slot is set through its descriptor instead (slower, still
    cheaper than ``__init__``).
    """
    if not dataclasses.is_dataclass(cls) or "__slots__" not in vars(cls):
        raise TypeError(f"{cls.__name__} is not a slotted dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__ that the constructor would skip")
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    params: list[str] = []
    names: list[str] = []
    for field in dataclasses.fields(cls):
        name = field.name
        names.append(name)
        if field.default is dataclasses.MISSING:
            params.append(name)
        else:
            namespace[f"_default_{name}"] = field.default
            params.append(f"{name}=_default_{name}")
    twin = type(f"_{cls.__name__}Fields", (), {"__slots__": tuple(vars(cls)["__slots__"])})
    try:
        probe: Any = object.__new__(twin)
        probe.__class__ = cls
    except TypeError:
        body = [f"    _set_{name}(self, {name})" for name in names]
        namespace.update({f"_set_{name}": getattr(cls, name).__set__ for name in names})
        body = ["    self = _new(_cls)", *body]
    else:
        namespace["_twin"] = twin
        body = ["    self = _new(_twin)", *(f"    self.{name} = {name}" for name in names)]
        body.append("    self.__class__ = _cls")
    source = "\n".join([f"def make(*, {', '.join(params)}):", *body, "    return self"])
    exec(source, namespace)  # made of the class's own field names
    make: Callable[..., T] = namespace["make"]
    make.__qualname__ = make.__name__ = f"new_{cls.__name__}"
    return make
