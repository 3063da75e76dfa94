"""The feedback schema's revisions, oldest first (Alembic reads them by revision id, not by import)."""
