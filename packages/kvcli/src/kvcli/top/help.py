"""The `?` screen of kvcli top: keys, states, colour thresholds and columns (fits 80 columns)."""

from __future__ import annotations

HELP = """\
[b]keys[/b]
  q         quit                     r         refresh now
  /         filter rows              escape    clear the filter / back
  p         pause / resume polling   s         sort: id hit ops l1 errors
  + -       poll faster / slower     enter, d  details of the selection
  ?         this help
  The filter matches id, url, state, model or tenant (enter keeps it).

[b]states[/b]
  [bold green]up[/]    answering
  [bold red]DOWN[/]  no answer (the note says why, and when it was last up)
  [bold magenta]AUTH[/]  it answers but refuses the token: give it with --token,
        --token-file or KVSERVER_API_TOKEN

[b]colours[/b]
  L1%        [yellow]>= 85[/]  [bold red]>= 95[/]
  hit% int   [yellow]20[/] / [bold red]50[/] points under hit% all (a hit-rate drop)
  errors     [bold red]red[/] while rising      nospace/s  [bold red]red[/] when stores are refused
  evict/s    [yellow]yellow[/] while L1 is full
  L2         [bold red]name↓[/] = tier down; q = write-behind queue; [red]-n[/] = dropped

[b]columns[/b]
  p99 ms     lookup latency p99 over the last interval
  model      models of the registered engines (exited engines expire)
  tenants    tenants holding L1 bytes or sessions
  A narrow terminal keeps instance, state, hit% int, L1%, errors, p99,
  ops/s and the note first; wider ones add the rest.

press escape or ? to close"""
