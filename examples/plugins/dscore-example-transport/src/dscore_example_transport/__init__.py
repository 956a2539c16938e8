"""An example third-party comm transport: counts the bytes of every collective and delegates."""
