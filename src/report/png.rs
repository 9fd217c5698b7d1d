//! The standalone SVG rasterized to PNG by `resvg`, with a system font.

use super::error::ReportError;
use super::layout::PNG_FONTS;

/// The standalone SVG as a PNG, with a system font for the text.
pub(super) fn rasterize(svg: &str) -> Result<Vec<u8>, ReportError> {
    use resvg::{tiny_skia, usvg};
    let mut options = usvg::Options::default();
    let db = options.fontdb_mut();
    db.load_system_fonts();
    let family = PNG_FONTS
        .iter()
        .find(|name| {
            db.faces()
                .any(|f| f.families.iter().any(|(n, _)| n.as_str() == **name))
        })
        .map(|name| name.to_string())
        .or_else(|| {
            db.faces()
                .find_map(|f| f.families.first().map(|(n, _)| n.clone()))
        })
        .ok_or(ReportError::NoFont)?;
    db.set_sans_serif_family(family.clone());
    options.font_family = family;
    let tree =
        usvg::Tree::from_str(svg, &options).map_err(|e| ReportError::Rasterize(e.to_string()))?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| ReportError::Rasterize(format!("bad size {size:?}")))?;
    pixmap.fill(tiny_skia::Color::WHITE);
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap
        .encode_png()
        .map_err(|e| ReportError::Rasterize(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::layout::FONT;

    #[test]
    fn text_is_drawn_in_the_png() {
        // Only text: without a font, the image would be blank.
        let svg = format!(
            r##"<svg xmlns="http://www.w3.org/2000/svg" width="120" height="40"><text x="4" y="28" font-family="{FONT}" font-size="24" fill="#000">step</text></svg>"##
        );
        let png = rasterize(&svg).unwrap();
        let image = resvg::tiny_skia::Pixmap::decode_png(&png).unwrap();
        assert_eq!((image.width(), image.height()), (120, 40));
        let dark = image
            .pixels()
            .iter()
            .filter(|p| p.red() < 128 && p.alpha() == 255)
            .count();
        assert!(dark > 50, "{dark} dark pixels: the text was not drawn");
    }
}
