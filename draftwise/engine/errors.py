"""Errors that cross module boundaries."""


class EngineFault(RuntimeError):
    """A failure of the engine itself, not of one request: a crashed tensor-parallel worker, or a
    step that failed for every request in it, alone as well as together. The engine does not retry
    it request by request; the caller fails the batch (the server keeps serving)."""
