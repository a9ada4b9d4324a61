"""Documents that cross a process boundary, shared by their producer and every consumer:
the engine wire format, the engine statistics file, the ``/health/memory`` report, the
OpenAI error envelope and an engine's command line. Imports nothing of ours."""
