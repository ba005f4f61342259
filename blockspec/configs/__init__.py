"""Ground floor: the target's and the drafts' configs as plain data, parsed from config.json.
Layers read their dims from these; nothing here imports torch or any other blockspec package."""
