"""Chat-E's data: the dialogue format, the corpora, the models built offline, a chat made plain, the generation
settings and the limits on what a request carries. No Gradio, FastAPI or SQLAlchemy here: training and serving both
use it."""
