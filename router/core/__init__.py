"""The decision core, no I/O: one snapshot of the endpoints per decision, then filters, scorers and a picker
(router.core.plugins), run by the scheduler (router.core.scheduler); the learned figures every scorer reads
(router.core.figures)."""
