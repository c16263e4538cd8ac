"""What the source worker tells the app, in the past tense."""

from __future__ import annotations

from textual.message import Message

from llmdiag.agent.loop import AgentState
from llmdiag.model import Diagnosis

__all__ = ["DiagnosisClosed", "DiagnosisOpened", "SnapshotReceived", "SourceEnded", "SourceFailed"]


class SnapshotReceived(Message):
    """A tick arrived: its snapshot, diagnoses and routing state, and what opened or closed since the last."""

    def __init__(self, state: AgentState, opened: list[Diagnosis], closed: list[Diagnosis]) -> None:
        super().__init__()
        self.state = state
        self.opened = opened
        self.closed = closed


class DiagnosisOpened(Message):
    def __init__(self, diagnosis: Diagnosis, ts: float) -> None:
        super().__init__()
        self.diagnosis = diagnosis
        self.ts = ts


class DiagnosisClosed(Message):
    def __init__(self, diagnosis: Diagnosis, ts: float) -> None:
        super().__init__()
        self.diagnosis = diagnosis
        self.ts = ts


class SourceEnded(Message):
    """The source has no more ticks (end of a recording)."""


class SourceFailed(Message):
    """Reading the source raised; the app shows why and keeps what it has."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error
