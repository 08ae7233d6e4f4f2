//! GEMM + ReduceScatter: out_r = rows r*Ms..(r+1)*Ms of sum_ranks(x @ w^T),
//! Ms = M / world, laid out so that one ncclReduceScatter per wave group
//! receives straight into the final output rows.
//!
//! The output is tiled per shard: shard s has `bands` = ceil(Ms / bm) row
//! bands starting at row s*Ms (its last band may be partial; the rows a
//! tile computes past its shard are never kept). Group g is the same local
//! bands a_g..b_g of every shard. The GEMM stores each tile into a send
//! buffer where group g occupies rows world*a_g*bm.. as `world` chunks of
//! (b_g - a_g)*bm rows, chunk s holding shard s's bands a_g..b_g row-major:
//! exactly the layout ReduceScatter wants, so rank r receives the sum of
//! chunk r into its output rows a_g*bm.. in place. The reordering happens in
//! the GEMM's stores (through a per-position row table); nothing is moved
//! after the collective. Chunks are whole bands, so the output is allocated
//! with `bands * bm` rows and the caller sees its first Ms.
//!
//! Cost model: the search runs the AllReduce search over a virtual output of
//! `bands` bands of world*tiles_n tiles (a group's bytes are its rows of
//! every shard: the ReduceScatter's input), with the machine's ReduceScatter
//! timing (a measured curve, or the ring's (W-1)/W * B over the bus).

use super::error::PlanError;
use super::gemm_all_reduce::{validate_common, ModeRequest, Schedule, AUTO_OVERLAP_MARGIN};
use super::groups::GroupPartition;
use super::predictor::{
    best_partition, combined_sequence, predict, predict_combined, predict_sequential,
    CollectiveKind, Gather, HardwareModel, Timeline,
};
use super::tiles::{OutputTiles, TileShape};
use super::waves::Waves;

#[derive(Debug, Clone, PartialEq)]
pub struct ReduceScatterRequest {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub world: u32,
    pub elem_bytes: u32,
    pub tile: TileShape,
    pub reserved_sms: u32,
    /// Forces groups of this many local bands.
    pub bands_per_group: Option<u32>,
    pub max_groups: u32,
    pub mode: ModeRequest,
    /// Combined stores (push, or the copy engines on 2 ranks): no collective
    /// follows the groups; each rank's own tiles add the peers' partials in the
    /// GEMM's epilogue (`predict_combined`), and the tiles run in
    /// [`ReduceScatterPlan::combined_order`].
    pub combined: bool,
    /// With `combined`, 2 ranks: the plan is an AllReduce's (the output is
    /// all `m` rows, each rank's own shard summed in its epilogue, then
    /// given to the peer: [`predict_combined`]'s gather); its sequential
    /// schedule is the library GEMM and one AllReduce.
    pub gather: Option<Gather>,
}

/// Auto's margin for combined stores (and the gathered AllReduce): overlap
/// unless it is predicted more than 5% slower than running back to back.
/// Forced, combined overlap ran 1.06-1.45x of sequential on all 16 shapes
/// of 2x H200 with push and with the copy engines (ReduceScatter; the
/// gathered AllReduce 1.04-1.24x), and at K = 14336, the shapes the general
/// margin (AUTO_OVERLAP_MARGIN) sent to sequential, its model ran 1-6%
/// pessimistic, the sequential prediction up to 5% optimistic: with a
/// margin of 1.0, a 1 us tie sent the copy engines' 4096 x 8192 x 14336
/// AllReduce to sequential (1.00x; overlapped 1.09-1.10x). A fused norm
/// keeps 1.0 (see [`plan_gemm_reduce_scatter`]).
pub const COMBINED_OVERLAP_MARGIN: f64 = 1.05;

/// One wave group: local bands of every shard, and where its collective runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScatterGroup {
    pub bands: std::ops::Range<u32>,
    /// Positions the group waits for (every shard's tiles of its bands).
    pub positions: std::ops::Range<u32>,
    pub tiles: u32,
    /// First row of the group's `world` chunks in the send buffer.
    pub send_row: u64,
    /// First row of the group in the (padded) output.
    pub recv_row: u64,
    /// Elements each rank receives: (b - a) * bm * n.
    pub recv_count: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ReduceScatterPlan {
    pub request: ReduceScatterRequest,
    pub schedule: Schedule,
    pub ctas: u32,
    pub waves: Waves,
    /// Rows of each shard (M / world) and its bands.
    pub shard_rows: u32,
    pub bands: u32,
    pub tiles_n: u32,
    pub groups: Vec<ScatterGroup>,
    /// Per position: the tile id (band-major over world*bands bands of
    /// tiles_n tiles), the first row of x it reads, the first row of the
    /// send buffer it writes, and its group.
    pub tile_order: Vec<u32>,
    pub load_rows: Vec<u32>,
    pub store_rows: Vec<u32>,
    pub tile_group: Vec<u32>,
    pub timeline: Timeline,
    /// The hardware's per-call cost of overlapping (`overlap_fixed_us`).
    pub overlap_fixed_us: f64,
    /// Combined stores: the positions between a group's last tile of the
    /// other shards and its first own tile ([`combined_sequence`]).
    pub combined_lead: u32,
}

impl ReduceScatterRequest {
    /// A gathered AllReduce with a fused norm after each group: its plans
    /// keep the lead and margin its op was measured with.
    fn fused_norm(&self) -> bool {
        self.gather.is_some_and(|g| g.norm)
    }

    fn validate(&self, hw: &HardwareModel) -> Result<(), PlanError> {
        let dims = [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("world", self.world),
            ("elem_bytes", self.elem_bytes),
        ];
        validate_common(
            dims,
            hw,
            self.reserved_sms,
            self.max_groups,
            self.bands_per_group,
        )?;
        if self.gather.is_some() && !(self.combined && self.world == 2) {
            return Err(PlanError::InvalidShape(
                "a gathered (AllReduce) plan needs combined stores on 2 ranks".into(),
            ));
        }
        if self.m % self.world != 0 {
            return Err(PlanError::InvalidShape(format!(
                "m must be divisible by the world size {}, got {}",
                self.world, self.m
            )));
        }
        Ok(())
    }
}

/// Plans GEMM + ReduceScatter. Overlap partition = uniform(bands_per_group)
/// if given, else the predicted best; Auto overlaps only where that beats
/// the sequential prediction by AUTO_OVERLAP_MARGIN (combined stores:
/// COMBINED_OVERLAP_MARGIN). The sequential plan is
/// one group of every band on all SMs (the op then runs the library GEMM and
/// one ReduceScatter instead).
pub fn plan_gemm_reduce_scatter(
    req: &ReduceScatterRequest,
    hw: &HardwareModel,
) -> Result<ReduceScatterPlan, PlanError> {
    req.validate(hw)?;
    // Each group's collective is a ReduceScatter of its rows of every shard.
    let hw = &hw.with_collective(CollectiveKind::ReduceScatter);
    // A gathered plan is an AllReduce's: its sequential schedule runs one.
    let sequential_hw = match req.gather {
        Some(g) => HardwareModel {
            comm: g.all_reduce,
            ..*hw
        },
        None => *hw,
    };
    let shard_rows = req.m / req.world;
    let tile = req.tile;
    let bands = shard_rows.div_ceil(tile.bm);
    let tiles_n = req.n.div_ceil(tile.bn);
    // The virtual output of the model: one band per local band, holding
    // every shard's tiles of it.
    let virtual_tiles = OutputTiles::new(bands * tile.bm, req.world * tiles_n * tile.bn, tile)?;
    let elem = req.elem_bytes;
    let overlap_ctas = hw.sms - req.reserved_sms;
    let (k, world) = (req.k, req.world);
    let sequential = predict_sequential(&virtual_tiles, k, &sequential_hw, world, elem)?;
    let mut combined_lead = 0;
    let overlap = match (req.mode, req.bands_per_group) {
        (ModeRequest::Sequential, _) => None,
        (mode, per) if req.combined => {
            let (p, t, lead) = best_combined(&virtual_tiles, k, overlap_ctas, hw, req, per)?;
            combined_lead = lead;
            let t = Timeline {
                sequential_us: sequential.sequential_us,
                ..t
            };
            // With a fused norm the margin stays 1.0: its op was measured so,
            // and the norm's overlapped plan at 4096 x 8192 x 14336 ran
            // 1.3-1.5x its prediction (push, 2x H200).
            let margin = if req.fused_norm() {
                1.0
            } else {
                COMBINED_OVERLAP_MARGIN
            };
            let pays = t.overlap_us + hw.overlap_fixed_us < margin * t.sequential_us;
            (mode == ModeRequest::Overlap || per.is_some() || pays).then_some((p, t))
        }
        (_, Some(b)) => {
            let p = GroupPartition::uniform(&virtual_tiles, b)?;
            let t = predict(&virtual_tiles, k, overlap_ctas, &p, hw, world, elem)?;
            Some((p, t))
        }
        (mode, None) => {
            let best = best_partition(
                &virtual_tiles,
                k,
                overlap_ctas,
                hw,
                world,
                elem,
                req.max_groups,
            )?;
            let pays = best.1.overlap_us + hw.overlap_fixed_us
                < AUTO_OVERLAP_MARGIN * best.1.sequential_us;
            (mode == ModeRequest::Overlap || pays).then_some(best)
        }
    };
    let (schedule, ctas, partition, timeline) = match overlap {
        Some((p, t)) => (Schedule::Overlap, overlap_ctas, p, t),
        None => (
            Schedule::Sequential,
            hw.sms,
            GroupPartition::whole(&virtual_tiles),
            sequential,
        ),
    };
    let total = req.world * bands * tiles_n;
    let mut plan = ReduceScatterPlan {
        request: req.clone(),
        schedule,
        ctas,
        waves: Waves::new(ctas, total)?,
        shard_rows,
        bands,
        tiles_n,
        groups: Vec::with_capacity(partition.len()),
        tile_order: Vec::with_capacity(total as usize),
        load_rows: Vec::with_capacity(total as usize),
        store_rows: Vec::with_capacity(total as usize),
        tile_group: Vec::with_capacity(total as usize),
        timeline,
        // A sequential call forks nothing: its one schedule costs what it
        // predicts.
        overlap_fixed_us: match schedule {
            Schedule::Overlap => hw.overlap_fixed_us,
            Schedule::Sequential => 0.0,
        },
        combined_lead,
    };
    let bm = tile.bm;
    for (g, group) in (0u32..).zip(&partition.groups) {
        let (a, b) = (group.bands.start, group.bands.end);
        let first = plan.tile_order.len() as u32;
        for s in 0..req.world {
            // Column by column over the group's bands of this shard: the
            // CTAs running at once share B panels.
            for tn in 0..tiles_n {
                for j in a..b {
                    plan.tile_order.push((s * bands + j) * tiles_n + tn);
                    plan.load_rows.push(s * shard_rows + j * bm);
                    plan.store_rows
                        .push(req.world * a * bm + s * (b - a) * bm + (j - a) * bm);
                    plan.tile_group.push(g);
                }
            }
        }
        let end = plan.tile_order.len() as u32;
        plan.groups.push(ScatterGroup {
            bands: a..b,
            positions: first..end,
            tiles: end - first,
            send_row: u64::from(req.world) * u64::from(a) * u64::from(bm),
            recv_row: u64::from(a) * u64::from(bm),
            recv_count: u64::from(b - a) * u64::from(bm) * u64::from(req.n),
        });
    }
    Ok(plan)
}

/// The uniform grouping and lead a combined-stores call is predicted
/// fastest with (`per` bands per group if given): the groups set how finely
/// the own tiles wait for the peers' partials, the lead (four waves; one
/// or two with a fused norm) how long those have to cross the link before
/// the first own tile.
fn best_combined(
    tiles: &OutputTiles,
    k: u32,
    ctas: u32,
    hw: &HardwareModel,
    req: &ReduceScatterRequest,
    per: Option<u32>,
) -> Result<(GroupPartition, Timeline, u32), PlanError> {
    let bands = tiles.tiles_m;
    let candidates: Vec<u32> = match per {
        Some(b) => vec![b],
        None => {
            // Powers of two and about a wave of the peers' tiles per group.
            let wave = ctas.div_ceil(tiles.tiles_n.div_ceil(req.world).max(1));
            let mut c: Vec<u32> = (0..8).map(|i| 1u32 << i).chain([wave, bands]).collect();
            c.retain(|&b| b <= bands && bands.div_ceil(b) <= req.max_groups.max(1));
            c.sort_unstable();
            c.dedup();
            c
        }
    };
    // Four waves of the peers' tiles before the first own tile: on 2x H200
    // the 16 shapes ran 1.242x (copy engines) and 1.272x (push) over cuBLAS
    // then NCCL against 1.215x and 1.258x with the model's pick of one or
    // two waves, which left the GEMM's CTAs waiting for partials still
    // crossing the link (16384 x 8192 x 1024 on the copy engines: 928 vs
    // 1055 us). With a fused norm the lead stays the model's pick of one or
    // two waves: that is what its op was measured with.
    let waves: &[u32] = if req.fused_norm() { &[1, 2] } else { &[4] };
    let mut best: Option<(GroupPartition, Timeline, u32)> = None;
    for b in candidates {
        let p = GroupPartition::uniform(tiles, b)?;
        for lead in waves.iter().map(|w| w * ctas) {
            let t = predict_combined(
                tiles,
                k,
                ctas,
                &p,
                hw,
                req.world,
                req.elem_bytes,
                lead,
                req.gather,
            )?;
            if best
                .as_ref()
                .map_or(true, |(_, bt, _)| t.overlap_us < bt.overlap_us)
            {
                best = Some((p.clone(), t, lead));
            }
        }
    }
    best.ok_or_else(|| PlanError::InvalidPartition("no grouping within max_groups".into()))
}

impl ReduceScatterPlan {
    /// The shard (owner rank) of the tile at plan position `p`.
    fn shard_of(&self, p: usize) -> u32 {
        self.tile_order[p] / self.tiles_n / self.bands
    }

    /// The positions of the plan in the order rank `rank` runs them with
    /// combined stores ([`combined_sequence`] with the plan's lead): per
    /// group its tiles of the other shards (pushed) and of its own, each
    /// part in the plan's order.
    pub fn combined_order(&self, rank: u32) -> Vec<usize> {
        let parts: Vec<[Vec<usize>; 2]> = self
            .groups
            .iter()
            .map(|g| {
                let (own, pushed): (Vec<usize>, Vec<usize>) = g
                    .positions
                    .clone()
                    .map(|p| p as usize)
                    .partition(|&p| self.shard_of(p) == rank);
                [pushed, own]
            })
            .collect();
        let counts: Vec<(u32, u32)> = parts
            .iter()
            .map(|[p, o]| (p.len() as u32, o.len() as u32))
            .collect();
        let mut next = vec![[0usize; 2]; parts.len()];
        combined_sequence(&counts, self.combined_lead)
            .into_iter()
            .map(|(g, own)| {
                let (g, i) = (g as usize, usize::from(own));
                next[g][i] += 1;
                parts[g][i][next[g][i] - 1]
            })
            .collect()
    }

    /// Each group's two parts on `rank` with combined stores, (group, own
    /// tiles?), in the order [`Self::combined_order`] finishes them (a
    /// part finishes at its last tile; an empty part where its group's
    /// other part does, before it).
    pub fn combined_finish_order(&self, rank: u32) -> Vec<(usize, bool)> {
        let mut last = vec![[None::<usize>; 2]; self.groups.len()];
        for (at, p) in self.combined_order(rank).into_iter().enumerate() {
            let g = self.tile_group[p] as usize;
            last[g][usize::from(self.shard_of(p) == rank)] = Some(at);
        }
        let mut parts: Vec<(usize, usize, bool)> = Vec::with_capacity(2 * last.len());
        for (g, [pushed, own]) in last.into_iter().enumerate() {
            let end = pushed.max(own).unwrap_or(0);
            parts.push((pushed.unwrap_or(end), g, false));
            parts.push((own.unwrap_or(end), g, true));
        }
        parts.sort_unstable();
        parts.into_iter().map(|(_, g, own)| (g, own)).collect()
    }

    /// What the call is predicted to take on the schedule chosen.
    pub fn predicted_us(&self) -> f64 {
        self.schedule
            .predicted_us(&self.timeline, self.overlap_fixed_us)
    }

    /// Rows of the send buffer the GEMM stores into: a chunk per rank, or
    /// with combined stores the peer's shard alone, laid out like the output
    /// (what the copy engines copy from; push stores it in the peer's slot).
    pub fn send_rows(&self) -> u64 {
        if self.request.combined {
            self.out_rows()
        } else {
            u64::from(self.request.world) * self.out_rows()
        }
    }

    /// Rows of the output as allocated (whole bands; the caller keeps shard_rows).
    pub fn out_rows(&self) -> u64 {
        u64::from(self.bands) * u64::from(self.request.tile.bm)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::{world, TILE};

    fn request(m: u32, n: u32, k: u32, world: u32) -> ReduceScatterRequest {
        ReduceScatterRequest {
            m,
            n,
            k,
            world,
            elem_bytes: 2,
            tile: TILE,
            reserved_sms: 24,
            bands_per_group: None,
            max_groups: 16,
            mode: ModeRequest::Overlap,
            combined: false,
            gather: None,
        }
    }

    /// Replays the plan's stores: every kept output row of every shard is
    /// written exactly once, into the chunk rank s receives, at the row of
    /// its final position.
    fn assert_stores_land_in_place(plan: &ReduceScatterPlan) {
        let req = &plan.request;
        let bm = req.tile.bm;
        // The chunked send layout (what a combined call replaces with combined_order).
        let mut written = vec![false; (u64::from(req.world) * plan.out_rows()) as usize];
        for p in 0..plan.tile_order.len() {
            let tile = plan.tile_order[p];
            let (band, tn) = (tile / plan.tiles_n, tile % plan.tiles_n);
            let (s, j) = (band / plan.bands, band % plan.bands);
            assert_eq!(plan.load_rows[p], s * plan.shard_rows + j * bm);
            let g = &plan.groups[plan.tile_group[p] as usize];
            assert!(g.positions.contains(&(p as u32)));
            assert!(g.bands.contains(&j));
            for r in 0..bm {
                let local = j * bm + r;
                let row = u64::from(plan.store_rows[p] + r);
                // Chunk s of the group's send block, at the row rank s's output has.
                let chunk = g.send_row + u64::from(s) * (g.recv_count / u64::from(req.n));
                assert_eq!(row - chunk + g.recv_row, u64::from(local));
                if tn == 0 && local < plan.shard_rows {
                    assert!(!std::mem::replace(&mut written[row as usize], true));
                }
            }
        }
        let kept = written.iter().filter(|&&w| w).count() as u32;
        assert_eq!(kept, req.m);
    }

    #[test]
    fn groups_cover_every_band_and_receive_in_place() {
        let plan =
            plan_gemm_reduce_scatter(&request(3000, 1000, 512, 2), &HardwareModel::h200()).unwrap();
        assert_eq!(plan.shard_rows, 1500);
        assert_eq!(plan.bands, 12);
        assert_eq!(plan.out_rows(), 1536);
        let mut band = 0;
        for g in &plan.groups {
            assert_eq!(g.bands.start, band);
            assert_eq!(g.recv_row, u64::from(band) * 128);
            band = g.bands.end;
        }
        assert_eq!(band, 12);
        assert_stores_land_in_place(&plan);
    }

    #[test]
    fn m_not_divisible_by_the_world_is_an_error() {
        let err = plan_gemm_reduce_scatter(&request(3001, 1024, 512, 2), &HardwareModel::h200())
            .unwrap_err();
        assert!(err.to_string().contains("divisible"), "{err}");
    }

    #[test]
    fn sequential_is_one_group() {
        let req = ReduceScatterRequest {
            mode: ModeRequest::Sequential,
            ..request(8192, 8192, 4096, 4)
        };
        let plan = plan_gemm_reduce_scatter(&req, &HardwareModel::h200()).unwrap();
        assert_eq!(plan.schedule, Schedule::Sequential);
        assert_eq!(plan.groups.len(), 1);
        assert_eq!(plan.ctas, 132);
        assert_stores_land_in_place(&plan);
    }

    proptest! {
        #[test]
        fn every_plan_stores_every_row_once(
            shard in 1u32..3000,
            n8 in 1u32..300,
            k in 1u32..8192,
            world in world(),
            per in prop::option::of(1u32..8),
            mode in prop::sample::select(vec![ModeRequest::Auto, ModeRequest::Overlap, ModeRequest::Sequential]),
            combined in any::<bool>(),
        ) {
            let req = ReduceScatterRequest { bands_per_group: per, mode, combined, ..request(shard * world, n8 * 8, k, world) };
            let plan = plan_gemm_reduce_scatter(&req, &HardwareModel::h200()).unwrap();
            prop_assert!(plan.groups.len() as u32 <= req.max_groups.max(plan.bands));
            assert_stores_land_in_place(&plan);
            if combined && plan.schedule == Schedule::Overlap {
                for rank in 0..world {
                    let mut order = plan.combined_order(rank);
                    order.sort_unstable();
                    prop_assert!(order.iter().enumerate().all(|(i, &p)| i == p));
                    // Every group's two parts once, its partials before its sums.
                    let finish = plan.combined_finish_order(rank);
                    prop_assert_eq!(finish.len(), 2 * plan.groups.len());
                    for g in 0..plan.groups.len() {
                        let at = |own: bool| finish.iter().position(|&e| e == (g, own));
                        prop_assert!(at(false).unwrap() < at(true).unwrap());
                    }
                }
            }
            // (A forced grouping overlaps whatever the prediction, as for AllReduce;
            // combined stores overlap unless predicted more than their margin slower.)
            if plan.schedule == Schedule::Overlap && mode == ModeRequest::Auto && per.is_none() {
                let margin = if combined { COMBINED_OVERLAP_MARGIN } else { 1.0 };
                prop_assert!(plan.timeline.overlap_us < margin * plan.timeline.sequential_us);
            }
        }
    }
}
