"""What is not training, kept out of the shipped trainer package: regeneration of chat data with
the target (`python -m trainer_tools.regen`) and the fixtures the tests, benchmarks and demo
playbooks build (tiny model directories, chat templates, an OpenAI-compatible stand-in server).

A release of the trainer holds `trainer/` only; the playbooks that need these add
`extra_paths: [../trainer_tools]` to their deploy step (SpecForge keeps data preparation beside
its training package the same way)."""
