"""The EMS context cache (docs/ems.md; CloudMatrix-Infer §4.4.1): the pool role and the client the
prefilling dies use."""
