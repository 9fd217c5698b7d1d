//! Sizes, margins and fonts of the drawn plots, shared by the SVG, the HTML page and the PNG.

/// Size of one plot in the standalone SVG, in user units (the PNG's pixels): 800 wide.
pub(super) const SVG_PLOT: (u32, u32) = (800, 250);
/// Size of one plot on the HTML page, which scales it to the screen's width: narrower, so that
/// its text stays legible on a phone.
pub(super) const PAGE_PLOT: (u32, u32) = (600, 270);
/// Height of the title block of the standalone SVG.
pub(super) const HEADER_HEIGHT: u32 = 56;
pub(super) const MARGIN_LEFT: f64 = 72.0;
pub(super) const MARGIN_RIGHT: f64 = 16.0;
pub(super) const MARGIN_TOP: f64 = 30.0;
pub(super) const MARGIN_BOTTOM: f64 = 42.0;
pub(super) const FONT: &str = "DejaVu Sans, Liberation Sans, Arial, Helvetica, sans-serif";
/// Families tried, in order, for the PNG's text.
pub(super) const PNG_FONTS: [&str; 4] = ["DejaVu Sans", "Liberation Sans", "Arial", "Noto Sans"];
