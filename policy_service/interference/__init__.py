"""The site's compute interference learned from its own shared runs (issue 35): the learner that
reads them from hook events and the history and hands the decision path its models."""
