"""Checkpoints: the verified orbax checkpointer (:mod:`.checkpointer`), every file operation on
a local disk or an object store (:mod:`.storage`), chunk checksums (:mod:`.integrity`), what
a failed read means (:mod:`.read_failures`), the newest committed step recorded in the
workdir (:mod:`.record`), one run per bucket (:mod:`.lease`) and the run's small files beside
object-store checkpoints (:mod:`.run_files`)."""
