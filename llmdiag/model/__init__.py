"""The data model shared by every layer (SPEC section 3): backends, signal
values, samples and snapshots, diagnoses and the penalties document."""

from llmdiag.model.backend import ENGINES, Backend, BackendURLError, split_backend_url
from llmdiag.model.diagnosis import (
    DIAGNOSIS_KINDS,
    HOST,
    PENALTIES_SCHEMA,
    BackendPenalty,
    BackendState,
    Diagnosis,
    Evidence,
    PenaltiesDocument,
    Reason,
    Severity,
    combine_penalties,
)
from llmdiag.model.na import NA, NaType, is_na, or_none
from llmdiag.model.signals import (
    Distribution,
    Labelled,
    SignalValue,
    Signals,
    decode_value,
    encode_value,
    label_key,
    parse_label_key,
)
from llmdiag.model.snapshot import (
    SNAPSHOT_SCHEMA,
    CollectorState,
    CollectorStatus,
    Sample,
    Scope,
    Snapshot,
    SnapshotError,
    read_snapshots,
    write_snapshots,
)

__all__ = [
    "DIAGNOSIS_KINDS", "ENGINES", "HOST", "NA", "PENALTIES_SCHEMA", "SNAPSHOT_SCHEMA",
    "Backend", "BackendPenalty", "BackendState", "BackendURLError", "CollectorState",
    "CollectorStatus", "Diagnosis", "Distribution", "Evidence", "Labelled", "NaType",
    "PenaltiesDocument", "Reason", "Sample", "Scope", "Severity", "SignalValue", "Signals",
    "Snapshot", "SnapshotError", "combine_penalties", "decode_value", "encode_value",
    "is_na", "label_key", "or_none", "parse_label_key", "read_snapshots", "split_backend_url",
    "write_snapshots",
]
