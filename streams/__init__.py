"""Stream processors: the Faust app that joins raw events into correlated history."""
