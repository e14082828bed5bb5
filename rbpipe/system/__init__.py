"""Operating-system plumbing: processes (start method, liveness, socket directories), file idioms, the learner's
SIGTERM stop and the test hooks read from the environment. Nothing here knows about groups or models."""
