//! Wave groups: runs of whole row bands that the communication stream
//! reduces as soon as the GEMM has stored all their tiles. Whole bands in
//! row-band order make each group one contiguous slice of `out`, so the
//! AllReduce runs in place with no packing.

use std::ops::Range;

use super::error::{require_positive, PlanError};
use super::staged::StagedPartition;
use super::tiles::OutputTiles;

/// A contiguous range of `out`, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CollectiveSlice {
    pub offset: u64,
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaveGroup {
    /// Positions of the row-band order whose tiles the group waits for.
    pub positions: Range<u32>,
    pub bands: Range<u32>,
    pub rows: Range<u32>,
    pub tiles: u32,
    pub slice: CollectiveSlice,
}

impl WaveGroup {
    fn spanning(tiles: &OutputTiles, bands: Range<u32>) -> Self {
        let rows = tiles.band_rows(bands.start).start..tiles.band_rows(bands.end - 1).end;
        let n = u64::from(tiles.n);
        Self {
            positions: bands.start * tiles.tiles_n..bands.end * tiles.tiles_n,
            tiles: (bands.end - bands.start) * tiles.tiles_n,
            slice: CollectiveSlice {
                offset: u64::from(rows.start) * n,
                count: u64::from(rows.end - rows.start) * n,
            },
            bands,
            rows,
        }
    }
}

/// Consecutive groups covering every band of the output, top to bottom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPartition {
    pub groups: Vec<WaveGroup>,
}

impl GroupPartition {
    /// band_counts[g] = number of consecutive row bands in group g; all >= 1, sum == tiles_m.
    pub fn from_band_counts(tiles: &OutputTiles, band_counts: &[u32]) -> Result<Self, PlanError> {
        if band_counts.is_empty() {
            return Err(PlanError::InvalidPartition(
                "band_counts must name at least one group, got none".into(),
            ));
        }
        if let Some(g) = band_counts.iter().position(|&c| c == 0) {
            return Err(PlanError::InvalidPartition(format!(
                "band_counts must all be >= 1, got 0 for group {g}"
            )));
        }
        let total: u64 = band_counts.iter().map(|&c| u64::from(c)).sum();
        if total != u64::from(tiles.tiles_m) {
            return Err(PlanError::InvalidPartition(format!(
                "band_counts must sum to tiles_m = {}, got {total}",
                tiles.tiles_m
            )));
        }
        let mut start = 0;
        let groups = band_counts
            .iter()
            .map(|&count| {
                let group = WaveGroup::spanning(tiles, start..start + count);
                start += count;
                group
            })
            .collect();
        Ok(Self { groups })
    }

    /// Groups of `bands_per_group` bands; the last group takes the remainder, so it may be smaller.
    pub fn uniform(tiles: &OutputTiles, bands_per_group: u32) -> Result<Self, PlanError> {
        require_positive(
            "bands_per_group",
            bands_per_group,
            PlanError::InvalidPartition,
        )?;
        let counts: Vec<u32> = (0..tiles.tiles_m)
            .step_by(bands_per_group as usize)
            .map(|start| bands_per_group.min(tiles.tiles_m - start))
            .collect();
        Self::from_band_counts(tiles, &counts)
    }

    /// One group of every band: the layout of a GEMM followed by a single AllReduce.
    pub fn whole(tiles: &OutputTiles) -> Self {
        Self {
            groups: vec![WaveGroup::spanning(tiles, 0..tiles.tiles_m)],
        }
    }

    pub fn band_counts(&self) -> Vec<u32> {
        self.groups.iter().map(|g| g.bands.len() as u32).collect()
    }

    /// Group id of every tile id (len = tiles.count()); `TileOrder::by_position`
    /// turns it into what the kernel reads.
    /// The partition must have been built for `tiles` (see [`Self::check_against`]).
    pub fn tile_group_table(&self, tiles: &OutputTiles) -> Vec<u32> {
        let group_of_band: Vec<u32> = (0u32..)
            .zip(&self.groups)
            .flat_map(|(g, group)| group.bands.clone().map(move |_| g))
            .collect();
        (0..tiles.count())
            .map(|p| group_of_band[tiles.coords(p).0 as usize])
            .collect()
    }

    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Rejects a partition that does not describe `tiles`; its fields are
    /// public, so it may have been built for other tiles or edited since.
    pub fn check_against(&self, tiles: &OutputTiles) -> Result<(), PlanError> {
        let band_counts = self.band_counts();
        if Self::from_band_counts(tiles, &band_counts)? == *self {
            Ok(())
        } else {
            Err(PlanError::InvalidPartition(format!(
                "groups must be the ranges that band counts {band_counts:?} give for {} x {} tiles of {} x {} outputs, got others",
                tiles.tiles_m, tiles.tiles_n, tiles.m, tiles.n
            )))
        }
    }
}

/// What the enqueueing code needs of one group, whatever the layout:
/// the positions it waits for and the block its collective runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collective {
    pub positions: Range<u32>,
    pub tiles: u32,
    pub slice: CollectiveSlice,
}

/// The wave groups of a plan: whole row bands reduced in place in `out`,
/// or runs of waves reduced in a staging buffer and un-reordered after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Partition {
    InPlace(GroupPartition),
    Staged(StagedPartition),
}

impl Partition {
    pub fn len(&self) -> usize {
        match self {
            Partition::InPlace(p) => p.len(),
            Partition::Staged(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_staged(&self) -> bool {
        matches!(self, Partition::Staged(_))
    }

    pub fn collectives(&self) -> Vec<Collective> {
        let of = |positions: &Range<u32>, tiles, slice| Collective {
            positions: positions.clone(),
            tiles,
            slice,
        };
        match self {
            Partition::InPlace(p) => p
                .groups
                .iter()
                .map(|g| of(&g.positions, g.tiles, g.slice))
                .collect(),
            Partition::Staged(p) => p
                .groups
                .iter()
                .map(|g| of(&g.positions, g.tiles, g.slice))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::{output_tiles, tiles};

    /// Turns arbitrary counts into valid ones for `tiles_m` bands.
    fn fit_counts(raw: &[u32], tiles_m: u32) -> Vec<u32> {
        let mut left = tiles_m;
        let mut counts: Vec<u32> = raw
            .iter()
            .map_while(|&c| {
                let take = c.min(left);
                left -= take;
                (take > 0).then_some(take)
            })
            .collect();
        if left > 0 {
            counts.push(left);
        }
        counts
    }

    fn assert_well_formed(tiles: &OutputTiles, partition: &GroupPartition) {
        let (mut position, mut offset) = (0, 0);
        for group in &partition.groups {
            assert_eq!(group.positions.start, position);
            assert!(!group.positions.is_empty());
            assert_eq!(group.tiles, group.bands.len() as u32 * tiles.tiles_n);
            assert_eq!(group.positions.len() as u32, group.tiles);
            assert_eq!(group.slice.offset, offset);
            assert_eq!(
                group.slice.offset,
                u64::from(group.rows.start) * u64::from(tiles.n)
            );
            assert_eq!(
                group.slice.count,
                group.rows.len() as u64 * u64::from(tiles.n)
            );
            position = group.positions.end;
            offset += group.slice.count;
        }
        assert_eq!(position, tiles.count());
        assert_eq!(offset, u64::from(tiles.m) * u64::from(tiles.n));
        assert!(partition.check_against(tiles).is_ok());

        let table = partition.tile_group_table(tiles);
        assert_eq!(table.len(), tiles.count() as usize);
        for (g, group) in partition.groups.iter().enumerate() {
            assert!(group
                .positions
                .clone()
                .all(|p| table[p as usize] == g as u32));
        }
    }

    #[test]
    fn uniform_leaves_the_remainder_to_the_last_group() {
        let tiles = tiles(1200, 256);
        assert_eq!(tiles.tiles_m, 10);
        let partition = GroupPartition::uniform(&tiles, 3).unwrap();
        assert_eq!(partition.band_counts(), [3, 3, 3, 1]);
        assert_eq!(partition.groups[3].rows, 1152..1200);
        assert_eq!(
            GroupPartition::uniform(&tiles, 50).unwrap(),
            GroupPartition::whole(&tiles)
        );
        assert!(matches!(
            GroupPartition::uniform(&tiles, 0),
            Err(PlanError::InvalidPartition(_))
        ));
    }

    #[test]
    fn bad_band_counts_are_rejected() {
        let tiles = tiles(1200, 256);
        for counts in [&[][..], &[5, 0, 5], &[5, 4], &[5, 6]] {
            assert!(
                matches!(
                    GroupPartition::from_band_counts(&tiles, counts),
                    Err(PlanError::InvalidPartition(_))
                ),
                "{counts:?}"
            );
        }
    }

    #[test]
    fn partition_for_other_tiles_is_rejected() {
        let partition = GroupPartition::uniform(&tiles(1200, 256), 5).unwrap();
        assert!(partition.check_against(&tiles(1200, 512)).is_err());
        assert!(partition.check_against(&tiles(1100, 256)).is_err());
        assert!(partition.check_against(&tiles(1200, 256)).is_ok());
    }

    proptest! {
        #[test]
        fn groups_tile_the_output_in_order(
            tiles in output_tiles(),
            raw in prop::collection::vec(1u32..64, 1..24),
        ) {
            let counts = fit_counts(&raw, tiles.tiles_m);
            let partition = GroupPartition::from_band_counts(&tiles, &counts).unwrap();
            prop_assert_eq!(partition.band_counts(), counts);
            assert_well_formed(&tiles, &partition);
        }

        #[test]
        fn uniform_groups_are_well_formed(tiles in output_tiles(), per_group in 1u32..400) {
            let partition = GroupPartition::uniform(&tiles, per_group).unwrap();
            prop_assert_eq!(partition.len() as u32, tiles.tiles_m.div_ceil(per_group));
            assert_well_formed(&tiles, &partition);
        }
    }
}
