"""The status page of `kvwire serve`: a page, the feed it polls, and the series it plots."""
