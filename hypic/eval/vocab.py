"""The closed word lists of the synthetic world.

Every name is invented, so a model cannot answer from pretraining and must read the documents;
every list is small, so a tiny model trained from scratch meets each word thousands of times and
a small BPE vocabulary holds each one as a single token. Value words (what questions ask for) and
filler words (what pads documents to length) are disjoint, so filler never looks like an answer;
a test checks this.
"""

FIRST_NAMES = (
    "Adrel Brisa Caddo Dorvin Elsra Faelin Garrow Hesper Ilvane Joran Kestra Lorn Mavra Nerin Oswin Perrin "
    "Quillan Rosk Sabel Tamsin Ulric Vesna Wrenna Yara Zorel Alven Bexa Corin Dalla Emmet Farra Gilde "
    "Halvor Iska Jessamy Kael Liora Merek Nolla Orla Pell Risa Soren Talia Ulla Vask Wilda Yorin"
).split()

LAST_NAMES = (
    "Ashcombe Brannock Coldwell Dunmore Elderby Farrow Greaves Hollin Ironside Jessop Kettering Larkspur "
    "Mossby Norcott Oakhurst Pemberly Quarrel Redfern Stavely Thornbury Underhill Vantock Whitlow Yarrowby "
    "Ambry Blackmere Crowle Dray Emberly Fallow Grindle Harrowgate Inkwell Jarrow Kemble Lowrie Marrick "
    "Netherby Orrin Pryde Quenby Rookwood Sallow Tunstall Umber Vell Wickham Yewdale"
).split()

CITIES = (
    "Quorvane Eldmere Brackwater Dunhollow Fernreach Galvost Harrowmere Istervale Kelmarsh Lindqvar "
    "Marrowby Nethercross Oskvale Pellingham Quillon Rastmoor Silverwick Tarnholt Ulverdane Vantmoor "
    "Westerholm Yarnmouth Zelmore Amberlee Bellhaven Corrowen Drevenfall Estwold Fallowmere Glimmerby "
    "Hollowcrest Ivorhold Kestrelle Lowmarsh Mirrowind Norhaven Orlwick Pyrmont Ravenholt Thistlewick"
).split()

REGIONS = "Northmarch Southfen Eastreach Westvale Highmoor Lowdell Midreach Farshore Greyfold Sunmere".split()

# Organisations are "<stem> <kind>", e.g. "Brassline Guild": two-word answers.
ORG_STEMS = (
    "Brassline Copperleaf Driftwood Emberhall Flintlock Greywater Hearthstone Ironbark Juniper Lanternfield "
    "Moonwell Northgate Oakspire Pinecrest Quicksilver Redbrook Saltmarsh Tidewell Underbough Willowmere"
).split()
ORG_KINDS = "Guild Company Society Works Trust Collective Institute Foundry Cooperative Syndicate".split()

JOBS = (
    "baker pilot weaver potter tailor cooper mason farmer fisher carpenter glassblower miller brewer "
    "cartographer locksmith blacksmith sailor gardener tanner printer chemist surveyor archivist engineer "
    "innkeeper shepherd jeweller bookbinder clockmaker ropemaker"
).split()
INSTRUMENTS = "harp flute lute fiddle cello oboe drum horn trumpet banjo zither bagpipe accordion mandolin".split()
PETS = "cat dog parrot tortoise ferret rabbit goat hedgehog owl pony lizard goose canary hamster donkey".split()
COLOURS = "red blue green yellow purple orange grey white black silver amber teal crimson violet".split()
FOODS = (
    "plum cake", "barley soup", "apple pie", "fish stew", "honey buns", "pear tart", "onion soup",
    "cheese pie", "lentil stew", "berry jam", "roast turnips", "pumpkin porridge",
)
PRODUCTS = (
    "copper kettles", "glass lanterns", "wool blankets", "oak barrels", "paper maps", "iron nails",
    "clay bricks", "silk ribbons", "leather boots", "brass clocks", "rope ladders", "tin whistles",
)
BUDGET_MOVES = ("grew", "shrank", "doubled", "halved", "stayed flat")
STAFF_SIZES = "twelve twenty thirty forty fifty sixty seventy eighty ninety".split()
RISKS = "flooding theft fire debt drought rust rot fraud storms pests".split()
ADVICE = (
    "hire more clerks", "repair the roof", "sell spare stock", "train new staff", "raise its prices",
    "open a branch", "cut its costs", "buy new tools",
)

# Filler: padding sentences with no facts in them.
FILLER_ACTS = "mended cleaned painted sorted moved checked carried fixed polished wrapped measured".split()
FILLER_OBJECTS = (
    "an old fence", "the garden gate", "a stack of letters", "the kitchen table", "a wooden chair",
    "the cellar door", "a heavy crate", "the front steps", "a box of buttons", "the attic window",
    "a pile of books", "the back wall",
)
FILLER_TIMES = (
    "last spring", "on most mornings", "before the winter", "after the long rain", "every week",
    "during the holidays", "late at night", "in the early autumn", "once a month", "at dawn",
)
FILLER_HABITS = (
    "rarely talks about", "often writes letters about", "enjoys long talks about",
    "once gave a short speech about", "keeps a notebook about", "has strong views on",
)
FILLER_TOPICS = (
    "the weather", "old songs", "the harvest", "the town square", "the river boats", "the village fair",
    "the scent of candles", "the spring festival", "the old bridge", "the night sky",
)
FILLER_GOES = "walked went cycled rode hurried wandered".split()
FILLER_PLACES = (
    "the market", "the old mill", "the harbour", "the library", "the town hall", "the orchard",
    "the river bank", "the chapel",
)
ORG_FILLER_ACTS = (
    "held a meeting about", "published a notice about", "reviewed", "updated", "discussed",
    "printed a leaflet about", "checked",
)
ORG_FILLER_OBJECTS = (
    "its old records", "the yearly accounts", "its storage rooms", "the delivery schedule",
    "its safety rules", "the guest handbook", "its opening hours", "the visitor log",
)
SCENES = (
    "the weather was calm", "many people came to the square", "the streets were busy",
    "a small crowd gathered near the well", "the evening bells rang", "the roads were muddy",
    "the market stalls were full", "the river ran high",
)
