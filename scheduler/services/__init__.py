"""The Django shell around the scheduler core: build hypergraphs from rows, run ticks, drive
migrations, settle predictor errors. Celery tasks call these; they call the pure core."""
