"""The process: the `fairlane` commands, the flags they share, the engine built from the settings, and
the server that drains before it stops. It assembles the other rooms; none of them imports it."""
