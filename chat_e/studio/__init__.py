"""Chat-E's operator page, in one package: the Train page (:mod:`.page`, served at ``/admin/``), the training runs it
starts from the app's feedback, records and watches (:mod:`.runs`), and the served model's Promote, Roll back, arena
and side by side (:mod:`.serving`). A run's progress file is the training's to write and this package's to read
(:mod:`chat_e.training.progress`)."""
