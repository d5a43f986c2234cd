"""Tasks and a vision-language model that live outside gx-ray, as a user's own package would hold them: the docs'
worked example (docs/how-to/add-a-task.md) and what the plug-in tests run."""
