"""The REST API's bodies as pydantic models: what the OpenAPI document describes, and what
FastAPI checks going in and out.

Most bodies are protobuf messages in their canonical JSON mapping, so their models are
derived from the messages' descriptors, once each: a field added to a ``.proto`` appears
here, with its type, without an edit.

- :func:`output_model` is what ``MessageToDict(always_print_fields_with_no_presence=True)``
  (:func:`conveyor_rest.app.to_json`) makes of a message: every field without presence is
  always there (a scalar at its default, ``[]``, ``{}``), a message-typed, ``optional``
  or oneof field only when set. Field names are the JSON names (lowerCamelCase), 64-bit
  integers strings, enums names (a number for a value these protos do not know), bytes
  base64, a Timestamp an RFC 3339 string, a Duration a string such as ``"1.5s"``.
- :func:`input_model` is what ``json_format.ParseDict`` takes: every field optional (and
  ``null`` as absent), by its JSON name or its proto name, integers as numbers or
  strings, enums by name or number. A field the message does not have is refused with a
  422 problem; a value the protobuf parser or the api then refuses is a 400 one.

The REST process's own bodies (problems, batch results, who am I, queue history) are
the plain models at the end.
"""

from __future__ import annotations

import keyword
from typing import Annotated, Any, Literal

from google.protobuf.descriptor import FieldDescriptor
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, WithJsonSchema, create_model

__all__ = [
    "BatchResult",
    "HistoryPoint",
    "Problem",
    "QueueHistory",
    "WhoAmI",
    "input_model",
    "output_model",
]

_INT32 = frozenset(
    {
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SFIXED32,
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_FIXED32,
    }
)
_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SFIXED64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_FIXED64,
    }
)
_FLOAT = frozenset({FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE})

#: A message descriptor (``Message.DESCRIPTOR``: the pure-Python or the upb class).
Descriptor = Any

_TIMESTAMP = Annotated[
    str,
    WithJsonSchema({"type": "string", "format": "date-time", "description": "RFC 3339"}),
]
_DURATION = Annotated[
    str,
    WithJsonSchema(
        {
            "type": "string",
            "pattern": r"^-?[0-9]+(\.[0-9]+)?s$",
            "description": 'seconds with an "s", e.g. "30s" or "0.500s"',
        }
    ),
]
_INT64_OUT = Annotated[
    str, WithJsonSchema({"type": "string", "format": "int64", "pattern": r"^-?[0-9]+$"})
]
_INT64_IN = Annotated[
    int | str,
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^-?[0-9]+$"}]}),
]
_BYTES = Annotated[str, WithJsonSchema({"type": "string", "format": "byte"})]

#: The well-known types, as their JSON mapping writes them.
_WELL_KNOWN: dict[str, Any] = {
    "google.protobuf.Timestamp": _TIMESTAMP,
    "google.protobuf.Duration": _DURATION,
    "google.protobuf.Struct": dict[str, Any],
    "google.protobuf.Value": Any,
    "google.protobuf.ListValue": list[Any],
    "google.protobuf.Empty": dict[str, Any],
    "google.protobuf.Any": dict[str, Any],
    "google.protobuf.FieldMask": str,
    "google.protobuf.BoolValue": bool,
    "google.protobuf.StringValue": str,
    "google.protobuf.BytesValue": _BYTES,
    "google.protobuf.Int32Value": int,
    "google.protobuf.UInt32Value": int,
    "google.protobuf.FloatValue": float,
    "google.protobuf.DoubleValue": float,
}
_WELL_KNOWN_64 = frozenset({"google.protobuf.Int64Value", "google.protobuf.UInt64Value"})


def _drop_default(schema: dict[str, Any]) -> None:
    # An absent field has no default to show (None only marks it unset here).
    schema.pop("default", None)


def _field_name(name: str) -> str:
    """A Python name for a proto field that clashes with nothing on BaseModel."""
    if keyword.iskeyword(name) or hasattr(BaseModel, name) or name.startswith("model_"):
        return f"{name}_"
    return name


class _Builder:
    """Models of one direction (``out`` or ``in``), one per message, made on demand."""

    def __init__(self, mode: Literal["out", "in"]) -> None:
        self.mode = mode
        self.models: dict[str, type[BaseModel]] = {}
        self.building: set[str] = set()

    def scalar(self, field: FieldDescriptor) -> Any:
        """The type of one value of ``field`` (repeated and map fields: of an element)."""
        kind = field.type
        if kind == FieldDescriptor.TYPE_MESSAGE:
            assert field.message_type is not None
            name = field.message_type.full_name
            if name in _WELL_KNOWN:
                return _WELL_KNOWN[name]
            if name in _WELL_KNOWN_64:
                return _INT64_OUT if self.mode == "out" else _INT64_IN
            if name in self.building:  # a recursive message: any JSON below this point
                return Any
            return self.model(field.message_type)
        if kind == FieldDescriptor.TYPE_ENUM:
            assert field.enum_type is not None
            names = tuple(value.name for value in field.enum_type.values)
            listed = {"type": "string", "enum": list(names)}
            if self.mode == "out":
                # A value newer than these protos comes as its number.
                return Literal[names] | int
            return Annotated[str | int, WithJsonSchema({"anyOf": [listed, {"type": "integer"}]})]
        if kind in _INT64:
            return _INT64_OUT if self.mode == "out" else _INT64_IN
        if kind in _INT32:
            return int
        if kind in _FLOAT:
            return float
        if kind == FieldDescriptor.TYPE_BOOL:
            return bool
        if kind == FieldDescriptor.TYPE_BYTES:
            return _BYTES
        return str

    def value(self, field: FieldDescriptor) -> Any:
        """The type of ``field``'s value: a list, a mapping or one value."""
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            return dict[str, self.scalar(entry.fields_by_name["value"])]  # type: ignore[misc]
        if field.is_repeated:
            return list[self.scalar(field)]  # type: ignore[misc]
        return self.scalar(field)

    def model(
        self,
        message: Descriptor,
        *,
        name: str | None = None,
        overrides: dict[str, tuple[Any, str]] | None = None,
    ) -> type[BaseModel]:
        """The model of ``message`` (``overrides``: field name -> (type, description)
        in place of the descriptor's, under another model ``name``)."""
        key = name or message.full_name
        if key in self.models:
            return self.models[key]
        self.building.add(message.full_name)
        try:
            fields: dict[str, Any] = {}
            for field in message.fields:
                kind, about = (overrides or {}).get(field.name, (self.value(field), None))
                if self.mode == "out":
                    info = (
                        Field(alias=field.json_name, title=field.json_name, description=about)
                        if not field.has_presence
                        else Field(
                            default=None,
                            alias=field.json_name,
                            title=field.json_name,
                            description=about,
                            json_schema_extra=_drop_default,
                        )
                    )
                    fields[_field_name(field.name)] = (kind, info)
                else:
                    info = Field(
                        default=None,
                        validation_alias=AliasChoices(field.json_name, field.name),
                        serialization_alias=field.json_name,
                        title=field.json_name,
                        description=about,
                    )
                    fields[_field_name(field.name)] = (kind | None, info)
            base = message.full_name.removeprefix(message.file.package + ".").replace(".", "_")
            title = name or (base if self.mode == "out" else f"{base}Input")
            config = ConfigDict(
                extra="ignore" if self.mode == "out" else "forbid",
                protected_namespaces=(),
                title=title,
            )
            model = create_model(title, __config__=config, __doc__=_doc(message), **fields)
        finally:
            self.building.discard(message.full_name)
        self.models[key] = model
        return model


def _doc(message: Descriptor) -> str:
    return f"The protobuf message {message.full_name}, in its canonical JSON mapping."


_OUT = _Builder("out")
_IN = _Builder("in")


def output_model(message: Descriptor) -> type[BaseModel]:
    """The model of ``message`` as the REST API sends it (see the module's docstring)."""
    return _OUT.model(message)


def input_model(
    message: Descriptor,
    *,
    name: str | None = None,
    overrides: dict[str, tuple[Any, str]] | None = None,
) -> type[BaseModel]:
    """The model of ``message`` as the REST API takes it in a body (see the module's
    docstring); ``overrides`` (field -> (type, description)) give some fields another
    type, as a model of another ``name``."""
    return _IN.model(message, name=name, overrides=overrides)


# ------------------------------------------------------------ the REST process's own


class Problem(BaseModel):
    """An RFC 9457 problem detail; ``code`` is the gRPC status name."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str = ""
    code: str


class TaskActionBody(BaseModel):
    """The body of a reschedule: when the task becomes due (RFC 3339)."""

    model_config = ConfigDict(extra="forbid")

    process_at: str = Field(description="RFC 3339 time, e.g. 2026-01-01T00:00:00Z")


class BatchBody(BaseModel):
    """A batch action on a selection: ids, or a queue and a state."""

    model_config = ConfigDict(extra="forbid")

    action: str = Field(description="cancel, run-now, delete, archive, revive or reschedule")
    ids: list[str] = Field(default_factory=list, max_length=10_000)
    queue: str = ""
    state: str = ""
    process_at: str | None = Field(None, description="for reschedule: RFC 3339 time")


class BatchResult(BaseModel):
    """How many tasks a batch action changed, and the ids it could not act on."""

    affected: int
    failures: dict[str, str] = Field(description="task id -> why the action failed on it")


class WhoAmI(BaseModel):
    """What the caller's token may do, as the api's AdminService.WhoAmI answers."""

    role: Literal["admin", "read-only", "none"] = Field(
        description="what the token may do on the AdminService: admin (reads and "
        "mutations), read-only (reads: a read-only token, or an admin one on a read-only "
        "api) or none (a producer or worker token)"
    )
    can_read: bool
    can_mutate: bool
    token_role: str = Field(
        description="the token's role as configured (admin, producer, worker, "
        "worker=<queue>+<queue>..., read-only); admin when auth is off"
    )
    token_name: str = Field(description="the token's name; empty when auth is off")
    auth_enabled: bool = Field(description="false: the api checks no tokens")
    read_only: bool = Field(description="the api refuses every mutation (CONVEYOR_READ_ONLY)")


class HistoryPoint(BaseModel):
    """One sample of a queue, and what changed since the one before."""

    at: str = Field(description="when the sample was taken (RFC 3339)")
    completed: int | None = Field(
        description="tasks completed since the previous sample (null for the first)"
    )
    failed: int | None = Field(
        description="tasks archived (failed for good) since the previous sample (null for "
        "the first)"
    )
    completed_per_minute: float | None = Field(
        description="completed over the time since the previous sample, per minute"
    )
    pending: int = Field(description="pending tasks at the sample")
    active: int = Field(description="running tasks at the sample")
    latency_seconds: float | None = Field(
        description="how long the queue's oldest pending task had waited since it became "
        "pending (0: nothing pending; null: not measured)"
    )


class QueueHistory(BaseModel):
    """A queue's samples over the last hour, oldest first: what the dashboard charts."""

    queue: str
    interval_seconds: float = Field(description="how often the REST process samples")
    window_seconds: float = Field(description="how far back samples are kept")
    points: list[HistoryPoint]
