"""Operating a run: the workdir checked and locked (:mod:`.workdir`, :mod:`.workdir_lock`), the
agreed stop on signals (:mod:`.signals`), the hang watchdog (:mod:`.watchdog`), where the time
went (:mod:`.goodput`), traces (:mod:`.profiling`), status lines (:mod:`.progress`) and a run
file that cannot be written (:mod:`.disk_errors`)."""
