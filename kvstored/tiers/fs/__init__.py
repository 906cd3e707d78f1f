"""The filesystem tier: bookkeeping on the event loop (tier.py), blocking job bodies on its I/O
threads (jobs.py), the syscalls they use (io.py), namespace records (records.py)."""
