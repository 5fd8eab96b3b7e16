"""Jobs as users write them for `icebarrier job exec`: plain Spark, DuckDB and PyIceberg scripts
that import nothing of icebarrier and find the catalog in their environment.

Each takes ``ENGINE_PAUSE`` (a point name) and ``ENGINE_PAUSE_FILE``: at that point it writes
the pid a test should kill (its own, or the Spark driver's) to the file and waits until the
file is gone, so a test can kill it there (``kill -9``) or let it go on."""
