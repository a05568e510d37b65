"""Store: the append-only record streams of a run directory (writer) and their readers."""

from .reader import RankData, Run, RunFollower, StreamReader, load_run
from .writer import RecordWriter, write_manifest

__all__ = ["RankData", "Run", "RunFollower", "StreamReader", "load_run", "RecordWriter", "write_manifest"]
