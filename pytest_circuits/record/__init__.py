"""The one record of a build's figures: its table of figures (`figures`), its typed schema (`schema`,
checked as it is read), its files (`store`), shard parts (`shards`), the further looks of the
sequential rule (`looks`, `seeds`), how kappa was measured (`kappa_method`) and its lenient reading
for drawing (`drawn`). Nothing here measures or decides: `rungs` measure, `gate` decides."""
