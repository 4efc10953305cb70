"""The runnable Beam jobs (extract, prepare, probe) and how they are run. Installed as
`elmo_pipeline.pipelines`.
"""
