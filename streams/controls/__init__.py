"""The eight ownership-gap controls: the rules as pure functions (``rules``) and the
Faust agent that judges them continuously (``agents``)."""
