"""Chat-E's operator side: training runs started from the app's feedback, recorded and watched (:mod:`.runs`)."""
